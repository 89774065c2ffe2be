"""HTTP route handlers, grouped by surface."""
