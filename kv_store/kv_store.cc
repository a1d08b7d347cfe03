#include "kv_store/kv_store.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_store/row_copy.h"

namespace infinigen {
namespace {

int HeadsOf(const GatherItem& item, const SequenceSpec& spec) {
  return item.heads < 0 ? spec.num_kv_heads - item.head_begin : item.heads;
}

}  // namespace

absl::Status KvStoreConfig::Validate() const {
  if (block_tokens < 1 || max_row_bytes < 2 ||
      capacity_bytes < static_cast<size_t>(block_tokens * max_row_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the KV store needs block_tokens >= 1 and capacity for at least one block of ",
                     block_tokens * max_row_bytes, " bytes"));
  }
  if (gather_threads < 1) return absl::InvalidArgumentError("gather_threads must be >= 1");
  if (lease <= absl::ZeroDuration()) return absl::InvalidArgumentError("the lease must be > 0");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<KvStore>> KvStore::Create(const KvStoreConfig& config) {
  IG_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<KvStore> store(new KvStore(config));
  ArenaOptions arena;
  arena.capacity_bytes = config.capacity_bytes;
  arena.block_bytes = static_cast<size_t>(config.block_tokens * config.max_row_bytes);
  arena.shared = config.shared_memory;
  arena.shm_path = config.shm_path;
  arena.huge_pages = config.huge_pages;
  arena.prefault_ahead_bytes = config.prefault_ahead_bytes;
  IG_ASSIGN_OR_RETURN(std::unique_ptr<Arena> a, Arena::Create(arena));
  absl::MutexLock lock(&store->mu_);
  store->arena_ = std::move(a);
  store->stats_.bytes_capacity =
      static_cast<int64_t>(store->arena_->num_blocks() * store->arena_->block_bytes());
  store->pool_ = std::make_unique<ThreadPool>(config.gather_threads);
  return store;
}

std::shared_ptr<KvStore::Sequence> KvStore::Find(StoreSequenceId seq) const {
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  return it == sequences_.end() ? nullptr : it->second;
}

uint8_t* KvStore::Row(const std::vector<int32_t>& blocks, int64_t slot, int64_t row_bytes) const {
  const int64_t per_block = static_cast<int64_t>(arena_->block_bytes()) / row_bytes;
  return arena_->Block(blocks[slot / per_block]) + (slot % per_block) * row_bytes;
}

absl::Status KvStore::Open(StoreSequenceId seq, const SequenceSpec& spec, absl::Time now) {
  if (spec.num_layers < 1 || spec.num_kv_heads < 1 || spec.head_dim < 1 ||
      spec.capacity_tokens < 0) {
    return absl::InvalidArgumentError(
        "a sequence needs num_layers, num_kv_heads and head_dim >= 1 and capacity_tokens >= 0");
  }
  if (spec.row_bytes() > config_.max_row_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("rows of ", spec.row_bytes(),
                                                   " bytes exceed the store's limit of ",
                                                   config_.max_row_bytes));
  }
  // Bounds before anything is sized from the spec (it comes from the network).
  if (spec.num_layers > kMaxLayers || spec.num_kv_heads > kMaxKvHeads) {
    return absl::InvalidArgumentError(absl::StrCat("a sequence has at most ", kMaxLayers,
                                                   " layers and ", kMaxKvHeads, " KV heads; got ",
                                                   spec.num_layers, " and ", spec.num_kv_heads));
  }
  if (spec.capacity_tokens > 0) {
    const int64_t token_bytes = 2 * int64_t{spec.num_layers} * spec.num_kv_heads * spec.row_bytes();
    const int64_t most =
        std::min<int64_t>(std::numeric_limits<int32_t>::max(),
                          static_cast<int64_t>(config_.capacity_bytes) / token_bytes);
    if (spec.capacity_tokens > most) {
      return absl::ResourceExhaustedError(
          absl::StrCat("a KV pool of ", spec.capacity_tokens, " tokens needs ", token_bytes,
                       " bytes per token; this store holds at most ", most, " such tokens"));
    }
  }
  auto s = std::make_shared<Sequence>();
  s->spec = spec;
  s->lease_end = now + config_.lease;
  {
    absl::MutexLock seq_lock(&s->mu);
    s->layers.resize(spec.num_layers);
    for (Layer& l : s->layers) {
      l.heads.resize(spec.num_kv_heads);
      if (spec.capacity_tokens > 0) {
        for (HeadRows& h : l.heads) h.slots.Resize(spec.capacity_tokens);
      }
    }
  }
  absl::MutexLock lock(&mu_);
  if (sequences_.contains(seq)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", seq, " is already open"));
  }
  sequences_.emplace(seq, std::move(s));
  ++stats_.sequences;
  return absl::OkStatus();
}

void KvStore::FreeSequence(Sequence& s) {
  s.mu.AssertHeld();
  for (Layer& l : s.layers) {
    for (HeadRows& h : l.heads) {
      stats_.bytes_used -=
          static_cast<int64_t>((h.k_blocks.size() + h.v_blocks.size()) * arena_->block_bytes());
      arena_->Free(h.k_blocks);
      arena_->Free(h.v_blocks);
      h.k_blocks.clear();
      h.v_blocks.clear();
    }
  }
  s.layers.clear();
}

absl::Status KvStore::Close(StoreSequenceId seq) {
  std::shared_ptr<Sequence> s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  return CloseIf(seq, s, absl::InfiniteFuture());
}

absl::Status KvStore::CheckTransferable(StoreSequenceId seq, const Sequence& s,
                                        const SequenceSpec& spec, absl::string_view verb) {
  if (s.spec.capacity_tokens > 0) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq,
                                                      " is a KV pool (its slots are not "
                                                      "positions): it cannot be ",
                                                      verb));
  }
  const SequenceSpec& had = s.spec;
  if (had.num_layers != spec.num_layers || had.num_kv_heads != spec.num_kv_heads ||
      had.head_dim != spec.head_dim || had.dtype != spec.dtype) {
    return absl::FailedPreconditionError(
        absl::StrCat("sequence ", seq, " was stored as ", had.num_layers, " layers x ",
                     had.num_kv_heads, " KV heads x ", had.head_dim, " ", DTypeName(had.dtype),
                     "; the worker expects ", spec.num_layers, " x ", spec.num_kv_heads, " x ",
                     spec.head_dim, " ", DTypeName(spec.dtype)));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvStore::Attach(StoreSequenceId from, StoreSequenceId to,
                                        const SequenceSpec& spec, int64_t max_length,
                                        absl::Time now) {
  if (from == to) {
    return absl::InvalidArgumentError(absl::StrCat("attach of sequence ", from, " to itself"));
  }
  std::shared_ptr<Sequence> s = Find(from);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", from));
  IG_RETURN_IF_ERROR(CheckTransferable(from, *s, spec, "attached"));
  absl::MutexLock seq_lock(&s->mu);
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(from);
  if (it == sequences_.end() || it->second != s || s->layers.empty()) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", from));
  }
  if (sequences_.contains(to)) {
    return absl::AlreadyExistsError(absl::StrCat("sequence ", to, " is already open"));
  }
  int64_t length = std::max<int64_t>(0, max_length);
  for (const Layer& l : s->layers) length = std::min(length, l.length);
  stats_.tokens_stored -= s->layers[0].rows - length;
  for (Layer& l : s->layers) l.length = l.rows = length;  // their blocks are reused by appends
  s->spec.owner = spec.owner;
  s->lease_end = now + config_.lease;
  sequences_.erase(it);
  sequences_.emplace(to, s);
  return length;
}

absl::StatusOr<int64_t> KvStore::Fork(StoreSequenceId from, StoreSequenceId to,
                                      const SequenceSpec& spec, int64_t length, absl::Time now) {
  if (from == to) {
    return absl::InvalidArgumentError(absl::StrCat("fork of sequence ", from, " to itself"));
  }
  std::shared_ptr<Sequence> s = Find(from);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", from));
  IG_RETURN_IF_ERROR(CheckTransferable(from, *s, spec, "forked"));
  auto copy = std::make_shared<Sequence>();
  copy->lease_end = now + config_.lease;
  const size_t block_bytes = arena_->block_bytes();
  std::vector<int32_t> blocks;
  std::vector<Layer> layers(spec.num_layers);
  {
    absl::MutexLock seq_lock(&s->mu);  // its appends wait, its gathers too
    if (s->layers.empty()) {
      return absl::NotFoundError(absl::StrCat("sequence ", from, " is closed"));
    }
    copy->spec = s->spec;  // under its lock: an Attach changes the owner
    copy->spec.owner = spec.owner;
    length = std::max<int64_t>(0, length);
    for (const Layer& l : s->layers) length = std::min(length, l.length);
    const int64_t per_block = static_cast<int64_t>(block_bytes) / spec.row_bytes();
    const int64_t blocks_per_head = (length + per_block - 1) / per_block;
    const int64_t heads = int64_t{spec.num_layers} * spec.num_kv_heads;
    {
      absl::MutexLock lock(&mu_);
      if (sequences_.contains(to)) {
        return absl::AlreadyExistsError(absl::StrCat("sequence ", to, " is already open"));
      }
      absl::StatusOr<std::vector<int32_t>> allocated =
          arena_->Allocate(blocks_per_head * 2 * heads);
      if (!allocated.ok()) {
        ++stats_.rejections;
        return allocated.status();
      }
      blocks = *std::move(allocated);
      stats_.bytes_used += static_cast<int64_t>(blocks.size() * block_bytes);
    }
    // Whole blocks, outside the store-wide lock (as appends and gathers copy): a block holds
    // rows of one (layer, KV head, K or V) only, and the rows past `length` in the last one are
    // overwritten by the copy's appends before anything reads them.
    auto next = blocks.begin();
    for (int layer = 0; layer < spec.num_layers; ++layer) {
      Layer& to_layer = layers[layer];
      to_layer.length = to_layer.rows = length;
      to_layer.heads.resize(spec.num_kv_heads);
      for (int g = 0; g < spec.num_kv_heads; ++g) {
        const HeadRows& from_head = s->layers[layer].heads[g];
        HeadRows& to_head = to_layer.heads[g];
        for (auto [src, dst] : {std::pair{&from_head.k_blocks, &to_head.k_blocks},
                                std::pair{&from_head.v_blocks, &to_head.v_blocks}}) {
          dst->assign(next, next + blocks_per_head);
          next += blocks_per_head;
          for (int64_t i = 0; i < blocks_per_head; ++i) {
            std::memcpy(arena_->Block((*dst)[i]), arena_->Block((*src)[i]), block_bytes);
          }
        }
      }
    }
  }
  {
    // Not while holding the source's lock: gathers lock sequences in address order.
    absl::MutexLock copy_lock(&copy->mu);
    copy->layers = std::move(layers);
  }
  absl::MutexLock lock(&mu_);
  if (sequences_.contains(to)) {  // opened meanwhile
    arena_->Free(blocks);
    stats_.bytes_used -= static_cast<int64_t>(blocks.size() * block_bytes);
    return absl::AlreadyExistsError(absl::StrCat("sequence ", to, " is already open"));
  }
  stats_.tokens_stored += length;
  ++stats_.sequences;
  sequences_.emplace(to, std::move(copy));
  return length;
}

absl::Status KvStore::CloseIf(StoreSequenceId seq, const std::shared_ptr<Sequence>& s,
                              absl::Time lease_ended_by) {
  absl::MutexLock seq_lock(&s->mu);
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second != s) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  }
  if (s->lease_end > lease_ended_by) {
    return absl::FailedPreconditionError(absl::StrCat("sequence ", seq, " was renewed"));
  }
  stats_.tokens_stored -= s->layers.empty() ? 0 : s->layers[0].rows;
  FreeSequence(*s);
  sequences_.erase(it);
  --stats_.sequences;
  return absl::OkStatus();
}

absl::StatusOr<int64_t> KvStore::RowsAfter(const Layer& l, const SequenceSpec& spec, int64_t n,
                                           std::span<const int32_t> at_slots) {
  if (spec.capacity_tokens == 0) {
    return absl::InvalidArgumentError(
        "slots were given for the rows of a sequence without a KV pool capacity: its rows are "
        "placed by position");
  }
  if (!CountMatches(n, spec.num_kv_heads, at_slots.size())) {
    return absl::InvalidArgumentError(absl::StrCat(at_slots.size(), " slots given for ", n,
                                                   " tokens x ", spec.num_kv_heads, " KV heads"));
  }
  int64_t rows = l.rows;
  for (int g = 0; g < spec.num_kv_heads; ++g) {
    int64_t used = l.heads[g].slots.size();  // a slot may extend the head's slots by one
    for (int64_t t = 0; t < n; ++t) {
      const int64_t slot = at_slots[t * spec.num_kv_heads + g];
      if (slot < 0 || slot >= spec.capacity_tokens || slot > used) {
        return absl::InvalidArgumentError(
            absl::StrCat("slot ", slot, " of KV head ", g, " is outside the ", used,
                         " slots in use + 1 (of ", spec.capacity_tokens, ")"));
      }
      if (slot == used) ++used;
    }
    rows = std::max(rows, used);
  }
  return rows;
}

absl::Status KvStore::Append(StoreSequenceId seq, int layer, int64_t start, int64_t n,
                             const uint8_t* k, const uint8_t* v, size_t bytes, int32_t* slots_out,
                             std::span<const int32_t> at_slots) {
  std::shared_ptr<Sequence> s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  const SequenceSpec& spec = s->spec;
  const int64_t row_bytes = spec.row_bytes();
  if (layer < 0 || layer >= spec.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", layer, " is outside [0, ", spec.num_layers, ")"));
  }
  if (n < 1 || bytes != static_cast<size_t>(n * spec.num_kv_heads * row_bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("append of ", n, " tokens carries ", bytes, " bytes per tensor; ", n, " x ",
                     spec.num_kv_heads, " heads x ", spec.head_dim, " x ", DTypeName(spec.dtype),
                     " = ", n * spec.num_kv_heads * row_bytes));
  }
  absl::MutexLock seq_lock(&s->mu);
  if (s->layers.empty()) return absl::NotFoundError(absl::StrCat("sequence ", seq, " is closed"));
  Layer& l = s->layers[layer];
  if (start != l.length) {
    return absl::InvalidArgumentError(absl::StrCat("append at token ", start, " of layer ", layer,
                                                   ", which holds ", l.length,
                                                   " tokens: appends must be in order"));
  }
  const bool pooled = spec.capacity_tokens > 0;
  if (pooled && n > 1 && l.rows + n > spec.capacity_tokens) {
    return absl::FailedPreconditionError(
        absl::StrCat("prefill of ", n, " tokens does not fit the sequence's capacity of ",
                     spec.capacity_tokens, " tokens (", l.rows, " stored)"));
  }
  // Plan: the blocks the new rows need, for every head, taken all at once or not at all.
  const int64_t per_block = static_cast<int64_t>(arena_->block_bytes()) / row_bytes;
  int64_t new_rows = pooled ? std::min(l.rows + n, spec.capacity_tokens) : l.rows + n;
  if (!at_slots.empty()) {
    IG_ASSIGN_OR_RETURN(new_rows, RowsAfter(l, spec, n, at_slots));
  }
  const int64_t blocks_needed =
      (new_rows + per_block - 1) / per_block - static_cast<int64_t>(l.heads[0].k_blocks.size());
  if (blocks_needed > 0) {
    absl::MutexLock lock(&mu_);
    auto blocks = arena_->Allocate(blocks_needed * 2 * spec.num_kv_heads);
    if (!blocks.ok()) {
      ++stats_.rejections;
      return blocks.status();
    }
    auto it = blocks->begin();
    for (HeadRows& h : l.heads) {
      h.k_blocks.insert(h.k_blocks.end(), it, it + blocks_needed);
      it += blocks_needed;
      h.v_blocks.insert(h.v_blocks.end(), it, it + blocks_needed);
      it += blocks_needed;
    }
    stats_.bytes_used += static_cast<int64_t>(blocks->size() * arena_->block_bytes());
  }
  // Apply.
  if (layer == 0) ++s->step;
  int64_t evictions = 0;
  for (int64_t t = 0; t < n; ++t) {
    for (int g = 0; g < spec.num_kv_heads; ++g) {
      HeadRows& h = l.heads[g];
      int64_t slot = l.rows + t;
      if (!at_slots.empty()) {
        slot = at_slots[t * spec.num_kv_heads + g];
        evictions += h.slots.PlaceAt(static_cast<int32_t>(slot), start + t, s->step);
      } else if (pooled) {
        bool evicted;
        slot = h.slots.Place(start + t, s->step, spec.eviction, &evicted);
        evictions += evicted;
      }
      const size_t src = static_cast<size_t>((t * spec.num_kv_heads + g) * row_bytes);
      std::memcpy(Row(h.k_blocks, slot, row_bytes), k + src, row_bytes);
      std::memcpy(Row(h.v_blocks, slot, row_bytes), v + src, row_bytes);
      if (slots_out != nullptr) slots_out[t * spec.num_kv_heads + g] = static_cast<int32_t>(slot);
    }
  }
  const int64_t old_rows = l.rows;
  l.rows = new_rows;
  l.length = start + n;
  absl::MutexLock lock(&mu_);
  ++stats_.appends;
  if (layer == 0) {  // tokens, not tokens x layers
    stats_.evictions += evictions / spec.num_kv_heads;
    stats_.tokens_stored += new_rows - old_rows;
  }
  return absl::OkStatus();
}

absl::Status KvStore::Gather(std::span<const GatherItem> items, int pieces_left) {
  // Lock the sequences in address order (no lock-order cycles between concurrent gathers; not
  // id order: Attach gives a sequence another id, its Sequence object stays).
  // This thread's scratch (capacity kept: a worker's decode step allocates nothing here), named
  // by references so that the copies on the pool's threads read the caller's.
  thread_local std::vector<std::pair<StoreSequenceId, std::shared_ptr<Sequence>>> seqs_scratch;
  thread_local std::vector<std::pair<const GatherItem*, int>> work_scratch;
  auto& seqs = seqs_scratch;
  auto& work = work_scratch;
  seqs.clear();
  work.clear();
  absl::Cleanup drop = [&seqs] { seqs.clear(); };  // the sequences are not kept alive past the call
  for (const GatherItem& item : items) {
    if (std::any_of(seqs.begin(), seqs.end(), [&](const auto& p) { return p.first == item.seq; })) {
      continue;
    }
    std::shared_ptr<Sequence> s = Find(item.seq);
    if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", item.seq));
    seqs.emplace_back(item.seq, std::move(s));
  }
  std::sort(seqs.begin(), seqs.end(), [](const auto& a, const auto& b) {
    return std::less<const Sequence*>()(a.second.get(), b.second.get());
  });
  auto seq_of = [&](StoreSequenceId id) -> Sequence& {
    return *std::find_if(seqs.begin(), seqs.end(), [&](const auto& p) {
              return p.first == id;
            })->second;
  };
  for (auto& [id, s] : seqs) s->mu.ReaderLock();
  // Validate everything before copying anything.
  absl::Status status;
  int64_t units = 0, bytes = 0, copy_bytes = 0;
  for (const GatherItem& item : items) {
    Sequence& s = seq_of(item.seq);
    const SequenceSpec& spec = s.spec;
    if (s.layers.empty()) {
      status = absl::NotFoundError(absl::StrCat("sequence ", item.seq, " is closed"));
      break;
    }
    if (item.layer < 0 || item.layer >= spec.num_layers) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "sequence ", item.seq, ": layer ", item.layer, " is outside [0, ", spec.num_layers, ")"));
      break;
    }
    const int heads = HeadsOf(item, spec);
    if (item.head_begin < 0 || heads < 0 || item.head_begin + heads > spec.num_kv_heads) {
      status = absl::InvalidArgumentError(
          absl::StrCat("sequence ", item.seq, ": KV heads [", item.head_begin, ", ",
                       item.head_begin + heads, ") are outside [0, ", spec.num_kv_heads, ")"));
      break;
    }
    const bool in_place = item.in_place();
    if (item.block_table.requested() &&
        (item.block_table.known < 0 || item.block_table.capacity < 0)) {
      status = absl::InvalidArgumentError(
          absl::StrCat("sequence ", item.seq, " layer ", item.layer,
                       ": a block table's known blocks (", item.block_table.known,
                       ") and capacity (", item.block_table.capacity, ") must not be negative"));
      break;
    }
    if (item.block_table.requested() && (item.head_begin != 0 || heads != spec.num_kv_heads)) {
      status = absl::InvalidArgumentError(
          absl::StrCat("sequence ", item.seq, " layer ", item.layer,
                       ": a gather by block table answers every KV head, not a part of them"));
      break;
    }
    if (!CountMatches(item.count, heads, item.slots.size()) ||
        (item.count > 0 && !in_place && (item.k_out == nullptr || item.v_out == nullptr))) {
      status = absl::InvalidArgumentError(
          absl::StrCat("sequence ", item.seq, " layer ", item.layer, ": ", item.slots.size(),
                       " indices given for ", item.count, " rows x ", heads, " KV heads"));
      break;
    }
    if (item.row_bytes > 0 && item.row_bytes != spec.row_bytes()) {
      status = absl::FailedPreconditionError(
          absl::StrCat("sequence ", item.seq, " now has rows of ", spec.row_bytes(), " bytes, not ",
                       item.row_bytes, ": it was closed and opened again during the gather"));
      break;
    }
    const int64_t rows = s.layers[item.layer].rows;
    for (int32_t slot : item.slots) {
      if (slot < 0 || slot >= rows) {
        status = absl::InvalidArgumentError(absl::StrCat("sequence ", item.seq, " layer ",
                                                         item.layer, ": token index ", slot,
                                                         " is outside [0, ", rows, ")"));
        break;
      }
    }
    if (!status.ok()) break;
    units += heads;
    bytes += 2 * static_cast<int64_t>(item.slots.size()) * spec.row_bytes();
    if (!in_place) copy_bytes += 2 * static_cast<int64_t>(item.slots.size()) * spec.row_bytes();
  }
  if (status.ok()) {
    // Work units: one (item, KV head) each, of the items that want rows or their addresses;
    // those by block table are answered here.
    work.reserve(units);
    for (const GatherItem& item : items) {
      const Sequence& s = seq_of(item.seq);
      if (item.block_table.requested()) {
        const Layer& l = s.layers[item.layer];
        for (int g = 0; g < s.spec.num_kv_heads; ++g) {
          const HeadRows& h = l.heads[g];
          AnswerHeadBlocks(item.block_table, s.spec.num_kv_heads, g, h.k_blocks.data(),
                           h.v_blocks.data(), static_cast<int64_t>(h.k_blocks.size()));
        }
        *item.block_table.blocks = static_cast<int64_t>(l.heads[0].k_blocks.size());
        continue;
      }
      for (int g = 0; g < HeadsOf(item, s.spec); ++g) work.emplace_back(&item, g);
    }
    auto copy = [&](int64_t u) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      const GatherItem& item = *work[u].first;
      const int g = work[u].second;
      Sequence& s = seq_of(item.seq);
      const int64_t row_bytes = s.spec.row_bytes();
      const HeadRows& h = s.layers[item.layer].heads[item.head_begin + g];
      const int32_t* idx = item.slots.data() + g * item.count;
      const int64_t per_block = static_cast<int64_t>(arena_->block_bytes()) / row_bytes;
      const HeadRowsView view{arena_->base(),    arena_->block_bytes(),
                              h.k_blocks.data(), h.v_blocks.data(),
                              row_bytes,         per_block};
      if (item.k_rows != nullptr && item.v_rows != nullptr) {  // in place: addresses only
        HeadRowAddresses(view, idx, item.count, item.k_rows + g * item.count,
                         item.v_rows + g * item.count);
      } else {
        CopyHeadRows(view, idx, item.count, item.k_out + g * item.count * row_bytes,
                     item.v_out + g * item.count * row_bytes);
      }
    };
    if (copy_bytes >= config_.parallel_gather_bytes) {
      pool_->ParallelFor(static_cast<int64_t>(work.size()), copy);
    } else {
      for (int64_t u = 0; u < static_cast<int64_t>(work.size()); ++u) copy(u);
    }
  }
  for (auto& [id, s] : seqs) s->mu.ReaderUnlock();
  if (!status.ok()) return status;
  // Fetch statistics for sequences that evict.
  for (const GatherItem& item : items) {
    Sequence& s = seq_of(item.seq);
    if (s.spec.capacity_tokens == 0) continue;
    absl::MutexLock seq_lock(&s.mu);
    if (s.layers.empty()) continue;
    for (int g = 0; g < HeadsOf(item, s.spec); ++g) {
      for (int64_t j = 0; j < item.count; ++j) {
        s.layers[item.layer].heads[item.head_begin + g].slots.Fetched(
            item.slots[g * item.count + j], s.step);
      }
    }
  }
  absl::MutexLock lock(&mu_);
  if (pieces_left == 0) ++stats_.gathers;
  stats_.bytes_gathered += bytes;
  return absl::OkStatus();
}

absl::Status KvStore::Release(StoreSequenceId seq, absl::Time now) {
  std::shared_ptr<Sequence> s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  absl::MutexLock seq_lock(&s->mu);
  absl::MutexLock lock(&mu_);
  auto it = sequences_.find(seq);
  if (it == sequences_.end() || it->second != s) {
    return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  }
  s->spec.owner.clear();  // no owner renews it
  s->lease_end = now + config_.lease;
  return absl::OkStatus();
}

int64_t KvStore::Renew(const std::string& owner, absl::Time now) {
  absl::MutexLock lock(&mu_);
  int64_t held = 0;
  for (auto& [id, s] : sequences_) {
    if (!owner.empty() && s->spec.owner == owner) {
      s->lease_end = now + config_.lease;
      ++held;
    }
  }
  return held;
}

int64_t KvStore::ReapExpired(absl::Time now) {
  std::vector<std::pair<StoreSequenceId, std::shared_ptr<Sequence>>> expired;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, s] : sequences_) {
      if (s->lease_end <= now) expired.emplace_back(id, s);
    }
  }
  // Each is closed only if it is still the sequence seen above and still expired: an owner may
  // renew, or close and open the same id, between the two locks.
  int64_t freed = 0;
  for (const auto& [id, s] : expired) {
    if (CloseIf(id, s, now).ok()) ++freed;
  }
  absl::MutexLock lock(&mu_);
  stats_.leases_expired += freed;
  return freed;
}

absl::StatusOr<int64_t> KvStore::Length(StoreSequenceId seq, int layer) const {
  std::shared_ptr<Sequence> s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  absl::ReaderMutexLock seq_lock(&s->mu);
  if (layer < 0 || layer >= static_cast<int>(s->layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  return s->layers[layer].length;
}

absl::StatusOr<SequenceSpec> KvStore::Spec(StoreSequenceId seq) const {
  absl::MutexLock lock(&mu_);  // Attach changes the owner under mu_
  auto it = sequences_.find(seq);
  if (it == sequences_.end()) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  return it->second->spec;
}

absl::StatusOr<LayerBlocks> KvStore::Blocks(StoreSequenceId seq, int layer) const {
  std::shared_ptr<Sequence> s = Find(seq);
  if (s == nullptr) return absl::NotFoundError(absl::StrCat("unknown sequence ", seq));
  absl::ReaderMutexLock seq_lock(&s->mu);
  if (layer < 0 || layer >= static_cast<int>(s->layers.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer ", layer, " out of range"));
  }
  LayerBlocks b;
  const Layer& l = s->layers[layer];
  b.rows = l.rows;
  b.row_bytes = s->spec.row_bytes();
  for (const HeadRows& h : l.heads) {
    b.k_blocks.push_back(h.k_blocks);
    b.v_blocks.push_back(h.v_blocks);
  }
  return b;
}

KvStoreStats KvStore::Stats() const {
  absl::MutexLock lock(&mu_);
  KvStoreStats s = stats_;
  s.block_bytes = static_cast<int64_t>(arena_->block_bytes());
  return s;
}

}  // namespace infinigen
