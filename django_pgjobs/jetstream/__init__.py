"""Queues carried by NATS JetStream (PGJOBS["QUEUES"][name]["TRANSPORT"] = "nats").

Imported only when a queue uses NATS: it needs the nats-py package (the `nats` extra).

- bridge: the process's NATS connection, on an asyncio loop of its own, for sync callers;
- messages: a job as a JetStream message, and back;
- streams: each queue's stream and durable consumer, created or updated from the settings;
- relay: publishes the outbox (due rows of NATS queues) and deletes what the stream took, on a
  thread of runjobs, as a chore of runjobs --once, or alone (relayjobs);
- source: the worker's source of jobs for NATS queues (fetching, answers, acknowledgements),
  and the worker runjobs runs when a queue uses NATS;
- deliveries: one message as the worker holds it, and the answer to a finished attempt;

"""
