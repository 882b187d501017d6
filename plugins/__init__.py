"""kvforge's built-in plugins. Each subpackage is registered through kvforge's own entry points,
exactly as a third-party plugin package would be."""
