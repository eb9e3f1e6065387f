"""Scheduling: requests, batches, policies, the managers and the two schedulers (docs/architecture.md).

The package imports nothing itself: the front end imports the request types from here without
torch, and builds a scheduler through ``radixserve.sched.build``."""
