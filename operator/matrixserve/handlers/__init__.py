"""kopf handlers: thin, level-based reconcilers that call adapters and the pure domain."""
