"""The processes around the scheduler: the engine-side client, the scheduler and detokenizer processes, their IPC."""
