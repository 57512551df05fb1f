"""Integrations with other projects' APIs (ART's Backend); each module imports its package when imported."""
