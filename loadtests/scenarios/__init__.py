"""The six benchmark scenarios, one module and one command each."""
