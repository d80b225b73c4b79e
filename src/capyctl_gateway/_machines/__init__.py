"""Several machines: the server's control channel, hosts and their ingress."""
