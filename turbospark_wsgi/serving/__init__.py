"""Admission, queueing and generation: a checked request in, service events out; no HTTP here.

service (the seam the resources call) admits through limits, prompts and the queue, takes a lease
on a model from registry, and returns a generation that runs on the one compute thread (compute),
ends on cancel and speaks in service events; response_store keeps stored responses. Below it:
engine/.
"""
