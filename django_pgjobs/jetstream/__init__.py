"""Queues carried by NATS JetStream (PGJOBS["QUEUES"][name]["TRANSPORT"] = "nats").

Imported only when a queue uses NATS: it needs the nats-py package (the `nats` extra).

- bridge: the process's NATS connection, on an asyncio loop of its own, for sync callers;
- messages: a job as a JetStream message, and back;
- streams: each queue's stream and durable consumer, created or updated from the settings;
- relay: publishes the outbox (due rows of NATS queues) and deletes what the stream took;
- consumer: `runjobs --queue <a NATS queue>`, running jobs from the queue's consumer;
- acknowledging: what the worker sends the server for each message it holds (answers,
  in-progress acknowledgements, messages given back unstarted);
- deliveries: one message as the worker holds it, and whether its delivery is still its own;
- answers: a finished attempt as an ack, a nak or a term (and a dead letter written back);
- workers: what runjobs and relayjobs run when a queue uses NATS;
- figures: the streams' and consumers' figures for the health report.
"""
