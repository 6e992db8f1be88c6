"""YAML configs (router); a package only so that setuptools ships the files as package data."""
