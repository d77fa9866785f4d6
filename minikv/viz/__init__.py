"""Pictures of the engine's traces: replay (trace → snapshots and captions), draw (snapshots →
pictures in the course colours), widgets (ipywidgets steppers) and figures (`python -m minikv
figures`: every picture in figures/, redrawn from engine runs)."""
