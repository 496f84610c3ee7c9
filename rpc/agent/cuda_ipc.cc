// CUDA IPC's bookkeeping on the agent (rpc/wire/device.h has the copies):
// whether tensors to a worker may go as handles, the buffers of frames sent
// so until their receivers release them, and the release itself.
#include "tandem/rpc/agent/agent_impl.h"

#include <algorithm>

#include "tandem/rpc/agent/connection_table.h"
#include "tandem/rpc/common/log.h"
#include "tandem/rpc/wire/device.h"

namespace tandem::rpc {

size_t AgentImpl::cuda_ipc_held() const {
  std::lock_guard<std::mutex> lock(ipc_mu_);
  return ipc_held_.size();
}

bool AgentImpl::ipc_to(int dest, const Connection* via) const {
  if (!options_.cuda_ipc || dest < 0 || dest == rank_ ||
      static_cast<size_t>(dest) >= workers_.size()) {
    return false;
  }
  const WorkerInfo& self = workers_[rank_];
  const WorkerInfo& peer = workers_[dest];
  if (self.cuda_devices == 0 || peer.cuda_devices == 0 || peer.process.empty() ||
      peer.process == self.process) {
    return false;  // (a handle cannot be opened in the process that made it)
  }
  {
    std::lock_guard<std::mutex> lock(ipc_mu_);
    const auto& refused = ipc_refused_by_;
    if (std::find(refused.begin(), refused.end(), dest) != refused.end()) return false;
  }
  if (via) return std::string(via->kind()) == "shm";
  auto c = conns_ ? conns_->to(dest) : nullptr;
  return c && std::string(c->kind()) == "shm";  // on this host
}

void AgentImpl::send_ipc_release(const ConnectionPtr& conn, int to, uint64_t token, bool failed) {
  Message m;
  m.kind = MessageKind::kRequest;
  m.id = 0;  // one way
  m.callee = kIpcReleaseCallee;
  m.values.emplace_back(static_cast<int64_t>(token));
  m.values.emplace_back(failed);
  // On the connection the frame came by; if that one is retiring or gone,
  // on the one that replaced it (else the sender holds its memory until
  // every connection to us has closed).
  for (const ConnectionPtr& c : {conn, conns_->to(to)}) {
    if (!c) continue;
    try {
      c->send(encode(m, options_.limits));
      return;
    } catch (const Error&) {
    }
  }
}

void AgentImpl::release_ipc(int from, uint64_t token, bool failed) {
  std::shared_ptr<device::IpcExport> buffers;  // freed outside the lock
  std::lock_guard<std::mutex> lock(ipc_mu_);
  if (failed &&
      std::find(ipc_refused_by_.begin(), ipc_refused_by_.end(), from) == ipc_refused_by_.end()) {
    ipc_refused_by_.push_back(from);
    protocol_log_->write("tandem[" + printable(name()) + "]: " + printable(workers_[from].name) +
                         " could not use this worker's CUDA IPC handles; CUDA tensors to it "
                         "go through host memory from now on");
  }
  auto it = ipc_held_.find(token);
  if (it == ipc_held_.end() || it->second.rank != from) return;  // (not this peer's to release)
  buffers = std::move(it->second.buffers);
  ipc_held_.erase(it);
}

void AgentImpl::drop_ipc_held(int rank) {
  std::vector<std::shared_ptr<device::IpcExport>> dropped;
  std::lock_guard<std::mutex> lock(ipc_mu_);
  for (auto it = ipc_held_.begin(); it != ipc_held_.end();) {
    if (rank < 0 || it->second.rank == rank) {
      dropped.push_back(std::move(it->second.buffers));
      it = ipc_held_.erase(it);
    } else {
      ++it;
    }
  }
}

}  // namespace tandem::rpc
