// The gRPC data plane: a gather's rows come back in Gather replies over the control channel, in
// calls whose replies stay under config.max_gather_reply_bytes (a dense layer's full read at long
// context is cut into several by rows).
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kv_store/client/data_plane.h"

namespace infinigen {
namespace {

namespace pb = kvstore::v1;

class GrpcDataPlane final : public KvDataPlane {
 public:
  GrpcDataPlane(KvControlPlane& control, const KvClientConfig& config)
      : control_(control), max_reply_bytes_(config.max_gather_reply_bytes) {}

  std::string name() const override { return "grpc"; }
  absl::Status Connect() override { return absl::OkStatus(); }

  // Items are cut into pieces of rows (every KV head's rows [r0, r1) of the item), and pieces go
  // several to a call. Each piece's reply rows are written where the item's buffers expect them.
  absl::Status Gather(const std::vector<ClientGatherItem>& items, const OpenSpecs& specs) override {
    IG_ASSIGN_OR_RETURN(const std::vector<int64_t> row_bytes, CopiedRowBytes(items, specs, name()));
    struct Piece {
      size_t item;
      int64_t r0, r1;
      bool whole;  // the item as the caller made it (not cut)
    };
    std::vector<Piece> pieces;
    for (size_t i = 0; i < items.size(); ++i) {
      const ClientGatherItem& it = items[i];
      // Only a well-formed item ([heads, count] slots) is cut; anything else goes whole, for
      // the store to refuse with its reason (a count whose product with the heads wraps, ...).
      const int64_t heads = specs.at(it.seq).num_kv_heads;
      const bool well_formed = it.count > 0 && heads > 0 &&
                               it.count <= static_cast<int64_t>(it.slots.size()) &&
                               static_cast<int64_t>(it.slots.size()) == heads * it.count;
      const size_t per_row = 2 * static_cast<size_t>(std::max<int64_t>(heads, 1) * row_bytes[i]);
      const int64_t rows = std::max<int64_t>(
          1, static_cast<int64_t>(max_reply_bytes_ / std::max<size_t>(per_row, 1)));
      if (!well_formed || it.count <= rows) {
        pieces.push_back({i, 0, it.count, !well_formed});
        continue;
      }
      for (int64_t r0 = 0; r0 < it.count; r0 += rows) {
        pieces.push_back({i, r0, std::min(it.count, r0 + rows), false});
      }
    }
    for (size_t p0 = 0; p0 < pieces.size();) {
      pb::GatherRequest req;
      size_t bytes = 0, p1 = p0;
      for (; p1 < pieces.size(); ++p1) {
        const Piece& pc = pieces[p1];
        const ClientGatherItem& it = items[pc.item];
        const int64_t heads = specs.at(it.seq).num_kv_heads;
        const size_t piece_bytes =
            pc.whole ? 0 : 2 * static_cast<size_t>(heads * (pc.r1 - pc.r0) * row_bytes[pc.item]);
        if (p1 > p0 && bytes + piece_bytes > max_reply_bytes_) break;
        bytes += piece_bytes;
        auto* item = req.add_items();
        item->set_sequence_id(it.seq);
        item->set_layer(it.layer);
        item->set_count(pc.r1 - pc.r0);
        if (pc.whole || (pc.r0 == 0 && pc.r1 == it.count)) {
          item->mutable_slots()->Add(it.slots.begin(), it.slots.end());
          continue;
        }
        for (int64_t g = 0; g < heads; ++g) {
          const auto first = it.slots.begin() + g * it.count;
          item->mutable_slots()->Add(first + pc.r0, first + pc.r1);
        }
      }
      pb::GatherResponse resp;
      IG_RETURN_IF_ERROR(control_.Gather(req, &resp));
      if (resp.results_size() != static_cast<int>(p1 - p0)) {
        return absl::InternalError("the KV store answered a gather with the wrong number of items");
      }
      // The store is a peer on the network: its reply fills the caller's buffers only if it is
      // exactly what they were sized for (a store of another version, or a bug, must not overrun
      // them or leave last step's rows in them with an OK).
      for (size_t p = p0; p < p1; ++p) {
        const auto& r = resp.results(static_cast<int>(p - p0));
        const size_t want = static_cast<size_t>(req.items(static_cast<int>(p - p0)).slots_size()) *
                            static_cast<size_t>(row_bytes[pieces[p].item]);
        if (r.k().size() != want || r.v().size() != want) {
          return absl::InternalError(absl::StrCat(
              "the KV store answered item ", pieces[p].item, " of a gather with ", r.k().size(),
              " + ", r.v().size(), " bytes; its rows take ", want, " each"));
        }
      }
      for (size_t p = p0; p < p1; ++p) {
        const auto& r = resp.results(static_cast<int>(p - p0));
        const Piece& pc = pieces[p];
        const ClientGatherItem& it = items[pc.item];
        if (r.k().empty()) continue;
        if (pc.whole || (pc.r0 == 0 && pc.r1 == it.count)) {  // the item's own layout
          std::memcpy(it.k_out, r.k().data(), r.k().size());
          std::memcpy(it.v_out, r.v().data(), r.v().size());
          continue;
        }
        const size_t row = static_cast<size_t>(row_bytes[pc.item]);
        const size_t piece_rows = static_cast<size_t>(pc.r1 - pc.r0);
        const int64_t heads = specs.at(it.seq).num_kv_heads;
        for (int64_t g = 0; g < heads; ++g) {
          const size_t dst = (static_cast<size_t>(g * it.count + pc.r0)) * row;
          const size_t src = static_cast<size_t>(g) * piece_rows * row;
          std::memcpy(it.k_out + dst, r.k().data() + src, piece_rows * row);
          std::memcpy(it.v_out + dst, r.v().data() + src, piece_rows * row);
        }
      }
      p0 = p1;
    }
    return absl::OkStatus();
  }

 private:
  KvControlPlane& control_;
  const size_t max_reply_bytes_;
};

}  // namespace

absl::StatusOr<std::vector<int64_t>> CopiedRowBytes(const std::vector<ClientGatherItem>& items,
                                                    const OpenSpecs& specs,
                                                    const std::string& transport) {
  // The caller sized its buffers for the rows of sequences it opened through this client.
  std::vector<int64_t> row_bytes;
  row_bytes.reserve(items.size());
  for (const auto& it : items) {
    if (it.k_rows != nullptr || it.v_rows != nullptr || it.block_table.requested()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the ", transport, " transport copies rows; it cannot gather them in place"));
    }
    auto spec = specs.find(it.seq);
    if (spec == specs.end()) {
      return absl::NotFoundError(absl::StrCat("sequence ", it.seq, " is not open on this client"));
    }
    row_bytes.push_back(spec->second.row_bytes());
  }
  return row_bytes;
}

std::unique_ptr<KvDataPlane> MakeGrpcDataPlane(KvControlPlane& control,
                                               const KvClientConfig& config) {
  return std::make_unique<GrpcDataPlane>(control, config);
}

}  // namespace infinigen
