"""The `local` e2e backend's cluster: upstream Kubernetes built by tools/kubernetes/build.py, run here."""
