// Command coredns is CoreDNS with only the plugins test/node/coredns.yaml's
// Corefile names. The release binary links every plugin, cloud DNS
// providers and tracers included, and took three times as long to build;
// the server, the plugins and their order (coredns's own directive list)
// are the release's.
package main

import (
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() { coremain.Run() }
