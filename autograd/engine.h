// The distributed backward engine: dependency-correct ("smart") execution of
// one backward pass over the autograd graph that a context recorded across
// workers.
//
// The graph. Inside a context every message carrying tensors that require
// grad is recorded as a pair: a SendBackward on the sender (next edges: the
// sent tensors' gradient edges) and a RecvBackward on the receiver (the
// received tensors' grad_fn), with the same autograd message id. Gradients
// flow from a RecvBackward to its paired SendBackward, on another worker.
//
// The problem. A worker's local subgraph may be fed by its own roots and by
// several of its SendBackwards, and only some sends will ever receive a
// gradient: a tensor sent whose result the loss never uses gets none.
// Running each incoming gradient through its own engine pass (PyTorch's
// "fast mode") runs shared subgraphs several times and hangs on unused
// sends. Waiting for every send hangs too. A node must run once, after every
// gradient that *will* reach it, and that needs to know which sends will be
// reached: a global question.
//
// Reach, recorded on the way forward. When a message is recorded, its sender
// walks the local graph below the sent tensors (only when this context has
// received something here; otherwise nothing below can lead off this
// worker) and collects the RecvBackwards it reaches. The message carries
// its reach: for each of those receives, the paired send's id plus that
// receive's own reach. By induction the reach of a message is every send, on
// any worker, that a gradient for it would reach. The autograd graph below a
// tensor never changes once made, so the reach is exact.
//
// One backward pass (a "graph task", id (root rank << 48) | counter):
//  1. Discovery, on the root worker alone: walk the local graph from the
//     roots; each RecvBackward reached contributes its message id and its
//     reach. The union is exactly the set of sends that will get a gradient,
//     on every worker. No messages, no waiting.
//  2. The root sends each other worker that owns such sends a `run` request
//     naming them. Each worker (the root included) walks its local graph
//     from its roots/sends and counts, for every node it reaches, the edges
//     from reached nodes into it (a send counts one more: the gradient that
//     will come from its RecvBackward). Gradients that arrive before `run`
//     are kept until it does.
//  3. Execution: a node whose count reaches zero is ready. Ordinary nodes
//     run with their pre- and post-hooks, and their outputs go to the next
//     nodes' input buffers (summed). AccumulateGrad nodes are not run: their
//     gradient is added to the context's gradients (never to .grad). A
//     RecvBackward sends its inputs to its paired send's worker (`grad`, one
//     way: no reply), or delivers them in place when that is this worker;
//     undefined gradients travel as None. Gradients from other workers are
//     delivered on the loop thread (bounded work); the root's backward()
//     thread runs the root's ready nodes itself, spinning briefly before it
//     sleeps, and elsewhere a pool thread runs them, one thread at a time
//     per task.
//  4. A worker's part is done when every node it reached has run. Its `run`
//     request then completes, and backward() returns once the root's own
//     part and every `run` are done. Sends nobody reached were never counted,
//     so nothing waits for them. Cost: one `run` request and reply per
//     worker with a part, plus one message per gradient.
// Failure: a node that throws, a gradient that cannot be delivered or taken,
// or a part that cannot start fails that worker's `run` (or, once it has
// answered, is told to the root with `fail`); a worker that dies fails its
// `run` with DisconnectedError; past the timeout the root fails with
// TimeoutError. The root then aborts the task everywhere and backward()
// throws. Errors name the worker they happened on. A task's record stays
// (its buffers freed) until its context is released, so late gradients and
// aborts that overtake `run` find it and are dropped.
#pragma once

#include "tandem/autograd/graph_task.h"
