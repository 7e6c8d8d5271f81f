"""Configuration: the YAML schema, its compilation and shared config versions."""
import os

# The example config (the repository's config.example.yaml; gateway/config/example.yaml links to it, so that a
# wheel holds its text): what `make serve` and `tandem serve` without --config serve, and `tandem cost
# estimate`'s default
EXAMPLE_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "example.yaml")
