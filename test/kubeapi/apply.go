package kubeapi

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/restmapper"
)

// ApplyOptions say how Apply creates objects.
type ApplyOptions struct {
	// Namespace is used for namespaced objects that carry none, as
	// `kubectl apply -n` does.
	Namespace string
	// DryRun has the server validate and admit every object (schema,
	// unknown fields, RBAC escalation checks) without storing any.
	DryRun bool
}

// Apply creates every object of a multi-document YAML manifest with strict
// field validation, so that a typo or an unknown field is an error. It
// returns the objects as sent.
func (s *Server) Apply(ctx context.Context, manifest []byte, opts ApplyOptions) ([]*unstructured.Unstructured, error) {
	cs, dyn := s.Clients()
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(cs.Discovery()))
	create := metav1.CreateOptions{FieldValidation: metav1.FieldValidationStrict}
	if opts.DryRun {
		create.DryRun = []string{metav1.DryRunAll}
	}
	var objs []*unstructured.Unstructured
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifest), 4096)
	for i := 0; ; i++ {
		var obj map[string]any
		if err := dec.Decode(&obj); errors.Is(err, io.EOF) {
			return objs, nil
		} else if err != nil {
			return objs, fmt.Errorf("document %d: %w", i, err)
		}
		if obj == nil {
			continue
		}
		u := &unstructured.Unstructured{Object: obj}
		gvk := u.GroupVersionKind()
		m, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return objs, fmt.Errorf("document %d (%s %s): %w", i, gvk.Kind, u.GetName(), err)
		}
		if m.Scope.Name() == meta.RESTScopeNameNamespace {
			if u.GetNamespace() == "" {
				u.SetNamespace(opts.Namespace)
			}
			_, err = dyn.Resource(m.Resource).Namespace(u.GetNamespace()).Create(ctx, u, create)
		} else {
			_, err = dyn.Resource(m.Resource).Create(ctx, u, create)
		}
		if err != nil {
			return objs, fmt.Errorf("document %d (%s %s): %w", i, gvk.Kind, u.GetName(), err)
		}
		objs = append(objs, u)
	}
}

// InstallCRDs applies manifest (CustomResourceDefinitions) for real and waits
// until the server serves every one of them.
func (s *Server) InstallCRDs(ctx context.Context, manifest []byte) {
	s.tb.Helper()
	objs, err := s.Apply(ctx, manifest, ApplyOptions{})
	if err != nil {
		s.tb.Fatalf("install CRDs: %v", err)
	}
	_, dyn := s.Clients()
	crds := schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"}
	for _, o := range objs {
		deadline := time.Now().Add(30 * time.Second)
		for {
			got, err := dyn.Resource(crds).Get(ctx, o.GetName(), metav1.GetOptions{})
			if err == nil && established(got) {
				break
			}
			if time.Now().After(deadline) {
				s.tb.Fatalf("CRD %s not established: %v", o.GetName(), err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

func established(crd *unstructured.Unstructured) bool {
	conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
	for _, c := range conds {
		m, _ := c.(map[string]any)
		if m["type"] == "Established" && m["status"] == "True" {
			return true
		}
	}
	return false
}

// ServiceAccountToken creates namespace/name (if missing) and returns a
// token of that account, as the kubelet would project into its pod.
func (s *Server) ServiceAccountToken(ctx context.Context, namespace, name string) string {
	s.tb.Helper()
	cs, _ := s.Clients()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: namespace}}
	_, err := cs.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		s.tb.Fatalf("create service account %s/%s: %v", namespace, name, err)
	}
	expiry := int64(3600)
	tok, err := cs.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &expiry}}, metav1.CreateOptions{})
	if err != nil {
		s.tb.Fatalf("token for %s/%s: %v", namespace, name, err)
	}
	return tok.Status.Token
}
