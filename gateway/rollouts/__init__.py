"""Shadow traffic, parity reports and gated progressive rollouts (issue #31)."""
