"""Hooks that capture layer inputs or per-example gradient norms, armed only on monitored steps."""
