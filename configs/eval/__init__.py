"""YAML configs (`expertcast eval --config`); a package only so that setuptools ships the files as package data."""
