"""Trace-driven simulation: the generic engine over the one driver, the compiled fast paths' front end, and
its reports (docs/design.md, "Layout")."""
