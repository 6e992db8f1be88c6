"""The graph decode path: the same policies as the eager driver, compiled (docs/design.md, "Graph-compatible decode path")."""
