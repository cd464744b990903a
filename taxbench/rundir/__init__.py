"""The run directory: what a run leaves on disk (records, step streams, manifest, provenance), and reading it back."""
