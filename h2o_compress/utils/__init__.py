"""Leaf utilities that every layer may use: errors, private paths, bounded file reads, output directories,
memory figures, the library version. They import nothing else of the package."""
