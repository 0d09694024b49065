"""Dynamic Resource Allocation: a kind as a DRA driver (the kubelet plugin, and ``kube``: the API server)."""
