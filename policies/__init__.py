"""Decisions as plain functions over plain data: no I/O, no web framework, no SQL."""
