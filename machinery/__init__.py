"""The layer under the recipe, a module per concern (README.md lists them): it imports no core module and no
tool (tests/unit/test_layers.py)."""
