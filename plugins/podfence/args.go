package main

import (
	"fmt"
	"strings"

	"github.com/podfence/podfence/pkg/cniconf"
)

type k8sArgs struct {
	name, namespace string
	// adoption: the ADD is an adoption's (cniconf.AdoptionArg), which a
	// DEL that ran already refuses.
	adoption bool
}

// parseK8sArgs reads K8S_POD_NAME, K8S_POD_NAMESPACE and podfence's
// cniconf.AdoptionArg from CNI_ARGS ("K=V;K=V"). Other keys are ignored,
// as every Kubernetes runtime passes more than these.
func parseK8sArgs(cniArgs string) (k8sArgs, error) {
	var a k8sArgs
	if cniArgs == "" {
		return a, nil
	}
	for _, kv := range strings.Split(cniArgs, ";") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return a, fmt.Errorf("CNI_ARGS: %q is not KEY=VALUE", kv)
		}
		switch k {
		case "K8S_POD_NAME":
			a.name = v
		case "K8S_POD_NAMESPACE":
			a.namespace = v
		case cniconf.AdoptionArg:
			a.adoption = v == "true"
		}
	}
	return a, nil
}
