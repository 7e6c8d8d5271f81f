"""Billing: prices, the usage ledger and per-tenant budgets."""
