#include "client/cast_error_report.h"

#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "wire/cast_error_report.h"
#include "wire/grpc_status.h"

namespace layercast::client {

absl::StatusOr<std::vector<LayerCastReport>> FetchCastErrorReport(
    const ShardSet& set, std::chrono::milliseconds timeout) {
  std::map<std::tuple<uint32_t, DType, uint64_t>, LayerCastReport> rows;
  for (uint32_t shard = 0; shard < set.addresses().size(); ++shard) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    layercast::v1::GetCastErrorResponse response;
    if (const grpc::Status status = set.stub(shard).GetCastError(&context, {}, &response);
        !status.ok()) {
      return wire::FromGrpcStatus(status,
                                  absl::StrCat("shard ", shard, " (", set.addresses()[shard], ")"));
    }
    for (const layercast::v1::LayerCastError& row : response.layers()) {
      if (row.dtype() == layercast::v1::FLOAT32 ||
          row.dtype() == layercast::v1::DTYPE_UNSPECIFIED ||
          !layercast::v1::DType_IsValid(row.dtype())) {
        continue;  // a dtype this build does not narrow to
      }
      const auto dtype = static_cast<DType>(row.dtype());
      LayerCastReport& report = rows[{row.layer(), dtype, row.version()}];
      report.layer = row.layer();
      report.dtype = dtype;
      report.version = row.version();
      ++report.shards;
      report.chunks += row.chunks();
      report.error.Add(wire::CastErrorFromProto(row));
    }
  }
  std::vector<LayerCastReport> out;
  out.reserve(rows.size());
  for (auto& [key, report] : rows) out.push_back(report);
  return out;
}

}  // namespace layercast::client
