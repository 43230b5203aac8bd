"""Admission, queueing and generation."""
