"""The request value: authentication, validation and the request pipeline (admit, decide, forward)."""
