"""Resilience: the attempt loop, circuit breakers, rate limits, health; wired by ``layer.Resilience``."""
