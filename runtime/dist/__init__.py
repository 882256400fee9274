"""Multi-process runtime pieces: host weight store, rank groups (modules are imported by name, nothing here)."""
