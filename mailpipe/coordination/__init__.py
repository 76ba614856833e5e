"""Coordination through Redis: key names, queue and task names, the enqueue markers, the email
leases, the fleet's model-call limit, what the broker holds, and worker heartbeats."""
