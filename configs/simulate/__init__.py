"""YAML configs (`expertcast simulate --config`); a package only so that setuptools ships the files as package data."""
