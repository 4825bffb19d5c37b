"""Integrations of fusedops with other libraries.

Each integration is a subpackage imported on its own (``fusedops.integrations.transformers``), so
that ``import fusedops`` never imports a library it does not need.
"""
