"""Conformance cases, one module per feature; each registers its cases on import."""
