"""Configuration: the YAML schema, its compilation and shared config versions."""
