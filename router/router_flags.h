// The router's serving flags, declared once onto RouterServerConfig for infinigen-router and
// `infinigen serve` (which runs the router in front of its in-process worker): the public
// address, TLS, API keys and per-key limits, admission, request limits, failover, metrics and
// the HTTP front door. What only a standalone router has (its workers, their TLS CA, health
// checks) infinigen-router's main.cc declares itself.
#pragma once

#include "common/flags.h"
#include "router/router_server.h"

namespace infinigen {

void RegisterRouterFlags(FlagSet& flags, RouterServerConfig& config);

}  // namespace infinigen
