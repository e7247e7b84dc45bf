// Package kubeinformer builds the sweeper's informers: shared informers of
// every object of one resource, as unstructured objects from a dynamic
// client, as client-go's dynamicinformer builds them. That package is not
// used because it imports client-go/informers, and with it every typed
// informer, lister and client of the core API: 356 of the 892 packages the
// sweeper's build had.
package kubeinformer

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"
)

// New is a shared informer of every object of gvr in all namespaces (the
// cluster-scoped kinds have none).
func New(client dynamic.Interface, gvr schema.GroupVersionResource) cache.SharedIndexInformer {
	objects := client.Resource(gvr)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return objects.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return objects.Watch(ctx, o)
		},
	}
	return cache.NewSharedIndexInformerWithOptions(
		cache.ToListWatcherWithWatchListSemantics(lw, client),
		&unstructured.Unstructured{},
		// No resync period: the reflector's relists and the watch are
		// the source of changes; a periodic resync would only replay the
		// store.
		cache.SharedIndexInformerOptions{ObjectDescription: gvr.String()},
	)
}
