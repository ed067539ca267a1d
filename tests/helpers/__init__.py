"""Builders shared by several test files (a test file never imports another)."""
