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
//     naming them, before it runs a node: that worker's walk, and its
//     wake-up if it slept, overlap the root's first nodes. Each worker (the
//     root included) walks its local graph from its roots/sends and counts,
//     for every node it reaches, the edges from reached nodes into it (a
//     send counts one more: the gradient that will come from its
//     RecvBackward). Gradients that arrive before `run` are kept until it
//     does.
//  3. Execution: a node whose count reaches zero is ready. Ordinary nodes
//     run with their pre- and post-hooks, and their outputs go to the next
//     nodes' input buffers (summed). AccumulateGrad nodes are not run: their
//     gradient is added to the context's gradients (never to .grad). A
//     RecvBackward sends its inputs to its paired send's worker (`grad`, one
//     way: no reply), or delivers them in place when that is this worker;
//     undefined gradients travel as None. RecvBackwards that run in a row
//     send together, one `grad` message per worker, before the next node
//     that computes runs (so a hop's gradients to one worker are one
//     message, and none waits on work). Gradients from other workers are
//     delivered where the agent delivers messages (its loop thread, or a
//     thread polling that connection: bounded work); the root's backward()
//     thread runs the root's ready nodes itself, spinning briefly before it
//     sleeps, and elsewhere a pool thread runs them, one thread at a time
//     per task.
//  4. A worker's part is done when every node it reached has run. Its `run`
//     request then completes, and backward() returns once the root's own
//     part and every `run` are done. The gradients for the root that the
//     part's last RecvBackwards leave ride in that reply (a PartReply), not
//     in a message before it, unless part-end hooks (autograd/pass.h) still
//     have work to do. Sends nobody reached were never counted, so nothing
//     waits for them. Cost: one `run` request and reply per worker with a
//     part, plus one message per run of RecvBackwards to one worker; a
//     part's `run` request is off the path (sent before the root's first
//     node), and so is its reply (it brings the part's last gradients).
// Failure: a node that throws, a gradient that cannot be delivered or taken,
// or a part that cannot start fails that worker's `run` (or, once it has
// answered, is told to the root with `fail`); a worker that dies fails its
// `run` with DisconnectedError; past the timeout the root fails with
// TimeoutError. Errors keep their kind on the way (a `run` reply carries
// it) and name the worker they happened on. The root then aborts the task
// everywhere (`abort`) and backward() throws the first error. A task's
// record stays (its buffers freed; autograd/graph_task.h has its phases)
// until its context is released, so late gradients and aborts that overtake
// `run` find it and are dropped.
//
// The Engine class runs this on one worker over its Contexts
// (autograd/context.h). It sends its messages (`run`, `grad`, `abort`,
// `fail`) and reaches its threads through an EngineLink: over an rpc::Agent
// in autograd/dist_autograd.h, in process in tests/autograd/engine_test.cc.
// What the link promises is what the steps above need of it:
//  1. run(worker, request) reaches that worker's Engine::run_part and its
//     future completes with that part's `done` (its PartReply), or with the
//     error that kept it from running, typed and naming the worker.
//  2. send_grads is one way; the receiver's Engine::on_grad_from_loop gets
//     the gradients on a delivery thread (the agent's loop thread, or one
//     polling the connection: rpc/transport.h, 8.). A
//     gradient lost on the way is noticed at the root's timeout.
//  3. abort and tell_root are best effort and never throw.
//  4. post runs a function later on a thread that may block (the pool).
#pragma once

#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/autograd/context.h"
#include "tandem/autograd/graph_task.h"
#include "tandem/rpc/future.h"
#include "tandem/rpc/trace.h"

namespace tandem::autograd {

// The gradients for one recorded message (a RecvBackward's, for its send),
// as they travel in a `grad` message or a `run` reply. On the wire, flat
// (one level less to encode and decode than a list of pairs: it is on the
// path of every hop): the message id, then a tuple (gradient or None, ...),
// for each message in turn. parse() checks them, naming `what` in the
// std::invalid_argument it throws.
struct MessageGrads {
  uint64_t message = 0;
  torch::autograd::variable_list grads;  // undefined: no gradient (None)

  static void append(std::vector<c10::IValue>& out, std::vector<MessageGrads> all);
  // items[first..]: at least one message's.
  static std::vector<MessageGrads> parse(const std::vector<c10::IValue>& items, size_t first,
                                         const char* what);
};

// What the root asks of a worker with a part: count from these sends.
struct RunRequest {
  uint64_t context = 0;
  uint64_t task = 0;
  int root = -1;
  bool keep_graph = false;
  std::chrono::milliseconds timeout{0};  // for the gradients the part sends
  std::vector<uint64_t> sends;           // message ids of this worker's sends
};

// What a part's `done`, and so its `run` reply, completes with (step 4):
// None, or the part's last gradients for the root (a tuple of MessageGrads'
// items).
using PartReply = c10::IValue;

// How an Engine reaches the other workers' engines and its own threads.
class EngineLink {
 public:
  virtual ~EngineLink() = default;
  // `worker`'s Engine::run_part(request), within request.timeout; the
  // future completes as that part does: with its PartReply, or its error
  // (typed, naming the worker). Throws if `worker` cannot be reached at all.
  virtual rpc::RawFuture run(int worker, const RunRequest& request) = 0;
  // One way: `worker`'s Engine::on_grad_from_loop(context, task, grads).
  // Throws if it cannot be sent.
  virtual void send_grads(int worker, uint64_t context, uint64_t task,
                          std::vector<MessageGrads> grads) = 0;
  // Best effort: `worker`'s Engine::on_abort(context, task).
  virtual void abort(int worker, uint64_t context, uint64_t task) noexcept = 0;
  // Best effort: `root`'s Engine::on_failure(context, task, error), the
  // error typed as it was and naming this worker.
  virtual void tell_root(int root, uint64_t context, uint64_t task,
                         std::exception_ptr error) noexcept = 0;
  // Runs `fn` later on a thread that may block (the agent's pool).
  virtual void post(std::function<void()> fn) = 0;
  // backward()'s timeout when it is given none (the agent's rpc_timeout).
  virtual std::chrono::milliseconds default_timeout() const = 0;
  // How long the root's backward() thread spins for news before it sleeps.
  virtual std::chrono::microseconds spin() const = 0;
  // The root's backward() thread waits for news: up to spin() it spins for
  // `news()`; then, where the transport lets it, it sleeps on the connection
  // it reads (rpc/transport.h, 10.) until news() holds, `until` passes, or
  // it can sleep there no more, `set_waker` holding meanwhile what ends
  // that sleep (for whoever makes news) and then null. Returns in any case:
  // the caller sleeps its usual way if there is no news. This one spins.
  virtual void wait_for(const std::function<bool()>& news,
                        const std::function<void(std::function<void()>)>& set_waker,
                        std::chrono::steady_clock::time_point until);
  // Whether this thread is the one gradients are delivered on (debug checks).
  virtual bool on_loop_thread() const = 0;
  // Where the engine adds its events (rpc/trace.h); null when not tracing.
  virtual std::shared_ptr<rpc::Tracer> tracer() const { return nullptr; }
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  Engine(std::shared_ptr<Contexts> contexts, std::shared_ptr<EngineLink> link);
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Steps 1-4 from this worker as the root; returns when every part is
  // done, or throws the first error. timeout < 0: the link's default; 0: none.
  void backward(uint64_t context, const std::vector<at::Tensor>& roots, bool retain_graph,
                std::chrono::milliseconds timeout);

  // A `run` request: this worker's part (steps 2-4). Throws for a request
  // that names an unknown context or send, or a task already run or
  // aborted. The future is the part's `done` (its value a PartReply).
  rpc::RawFuture run_part(const RunRequest& request);
  // A `grad` message, on the delivery thread: bounded work that never blocks
  // (ready nodes run on the pool, or on the root's backward() thread). A
  // gradient that cannot be taken fails the task, told to its root.
  void on_grad_from_loop(uint64_t context, uint64_t task, std::vector<MessageGrads> grads);
  // A failure of `task` noticed on the delivery thread: told to its root,
  // right here if that is this worker, else from a pool thread.
  void fail_from_loop(uint64_t context, uint64_t task, std::exception_ptr error);
  // A `fail` message: a part of this root's `task` failed after answering.
  void on_failure(uint64_t context, uint64_t task, std::exception_ptr error);
  // An `abort` message from the root (may overtake `run`).
  void on_abort(uint64_t context, uint64_t task);

  // For debug_info: one line per backward pass not finished here, saying
  // where it waits (gradients from which worker, parts not done).
  std::string describe(const std::function<std::string(int)>& worker_name) const;
  // backward() calls made here (as the root), and parts run here (the
  // root's own included) that ran to their end.
  uint64_t passes() const { return passes_.load(std::memory_order_relaxed); }
  uint64_t parts_done() const { return parts_done_.load(std::memory_order_relaxed); }
  // One message's gradients from another worker, taken here: from a `grad`
  // message, or riding in a `run` request or reply.
  uint64_t gradients_received() const { return received_.load(std::memory_order_relaxed); }

 private:
  struct Join;

  std::shared_ptr<GraphTask> task_of(ContextState& ctx, uint64_t task);   // ctx.mu held
  std::shared_ptr<GraphTask> find_task(uint64_t context, uint64_t task);  // or null
  // The recorded sends of these message ids (ctx.mu held); throws naming a missing one.
  std::vector<std::shared_ptr<SendBackward>> sends_of(ContextState& ctx,
                                                      const std::vector<uint64_t>& messages) const;
  void run_root_part(const std::shared_ptr<ContextState>& ctx,
                     const std::shared_ptr<GraphTask>& task, Join& join,
                     std::chrono::steady_clock::time_point start,
                     std::chrono::milliseconds timeout);
  // What a drain's RecvBackwards left for other workers (step 3), in order.
  using Outbox = std::vector<std::pair<int, MessageGrads>>;
  // Sends `out` (one message per worker) and empties it; false, the task
  // failed, when that could not be done.
  bool send_out(const std::shared_ptr<GraphTask>& task, Outbox& out);
  // Takes `worker`'s gradients out of `out`, as a PartReply.
  static PartReply take_for(Outbox& out, int worker);
  // Gives the gradients to their sends (any thread; bounded); throws if
  // they cannot be taken.
  void accept_grads(uint64_t context, uint64_t task, std::vector<MessageGrads> grads);
  void drain(const std::shared_ptr<ContextState>& ctx, const std::shared_ptr<GraphTask>& task);
  // Runs one node; a RecvBackward's gradients for another worker go to `out`.
  torch::autograd::variable_list run_node(const std::shared_ptr<ContextState>& ctx,
                                          const std::shared_ptr<GraphTask>& task,
                                          torch::autograd::Node& fn,
                                          torch::autograd::variable_list inputs, Outbox& out);
  // A failure here in `task`, told to its root (failing the task in place
  // when this worker is the root). May call another worker: not on the loop.
  void tell_root(uint64_t context, uint64_t task, std::exception_ptr error);

  const std::shared_ptr<Contexts> contexts_;
  const std::shared_ptr<EngineLink> link_;
  const int rank_;
  const std::string name_;  // this worker's, for messages
  std::atomic<uint64_t> next_task_{1};
  std::atomic<uint64_t> passes_{0}, parts_done_{0}, received_{0};
};

}  // namespace tandem::autograd
