"""Runnable examples: small real models for the tools and their tests."""
