"""YAML configs (`expertcast sweep --config`); a package only so that setuptools ships the files as package data."""
