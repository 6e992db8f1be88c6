"""YAML configs (tiny_default); a package only so that setuptools ships the files as package data."""
