"""Persistence: SQLAlchemy models, engine set-up, repositories and migrations."""
