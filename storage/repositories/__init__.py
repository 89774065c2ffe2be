"""Repositories: the only code that speaks SQL. Tenant data is always read by tenant."""
