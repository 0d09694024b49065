"""What the kind backend needs on these machines only (docs/kind.md, "Adaptations"): the offline route
(offline.py: kind, the node image and the project's images from the local caches), the Docker engine the
run starts and stops itself (engine.py), and the host record it is checked against (host.py). A machine with
a registry and a Docker engine takes none of it: e2e/backends/kind.py runs the user's path there."""
