// The sandbox process of every pod on the local cluster (the role of upstream's pause image, which
// cannot be pulled here): it holds the pod's namespaces, reaps the orphans re-parented to it, and
// exits on SIGINT or SIGTERM.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for received := range signals {
		if received != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
