"""Pure translations between wire formats (no I/O): an endpoint a backend does not speak is served by one it does."""
