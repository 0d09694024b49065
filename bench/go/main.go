// Command goplugin serves the device plugin API on a unix socket the way a typical Go device plugin does
// (squat's generic-device-plugin, NVIDIA's): grpc-go, the kubelet's generated API, and an Allocate that
// looks each requested device up, checks it is healthy and builds the container's answer afresh.
// bench/bench_rpc.py pairs plugvisor's Allocate with it: same devices, same request, same answer.
//
//	goplugin SOCKET DEVICES
package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"sync"
	"syscall"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type device struct {
	health string
	specs  []*pluginapi.DeviceSpec
	envs   map[string]string
}

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	mu      sync.RWMutex // held by Allocate, as a plugin whose rescans replace the map must
	devices map[string]device
	list    []*pluginapi.Device
}

func newPlugin(n int) *plugin {
	p := &plugin{devices: make(map[string]device, n)}
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("gpu%d", i)
		p.devices[id] = device{
			health: pluginapi.Healthy,
			specs: []*pluginapi.DeviceSpec{
				{ContainerPath: fmt.Sprintf("/dev/nvidia%d", i), HostPath: fmt.Sprintf("/dev/nvidia%d", i), Permissions: "rw"},
				{ContainerPath: "/dev/nvidiactl", HostPath: "/dev/nvidiactl", Permissions: "rw"},
			},
			envs: map[string]string{"VISIBLE_DEVICES": id},
		}
		p.list = append(p.list, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	return p
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: p.list}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	p.mu.RLock()
	defer p.mu.RUnlock()
	response := &pluginapi.AllocateResponse{}
	for _, container := range request.ContainerRequests {
		answer := &pluginapi.ContainerAllocateResponse{Envs: map[string]string{}}
		for _, id := range container.DevicesIds {
			dev, ok := p.devices[id]
			if !ok || dev.health != pluginapi.Healthy {
				return nil, status.Errorf(codes.InvalidArgument, "unknown or unhealthy device %q", id)
			}
			answer.Devices = append(answer.Devices, dev.specs...)
			for key, value := range dev.envs {
				answer.Envs[key] = value
			}
		}
		response.ContainerResponses = append(response.ContainerResponses, answer)
	}
	return response, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: goplugin SOCKET DEVICES")
		os.Exit(2)
	}
	count, err := strconv.Atoi(os.Args[2])
	if err != nil || count < 1 {
		fmt.Fprintf(os.Stderr, "goplugin: DEVICES: %q is not a positive number\n", os.Args[2])
		os.Exit(2)
	}
	listener, err := net.Listen("unix", os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "goplugin:", err)
		os.Exit(1)
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, newPlugin(count))
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-stop; server.Stop() }()
	if err := server.Serve(listener); err != nil {
		fmt.Fprintln(os.Stderr, "goplugin:", err)
		os.Exit(1)
	}
}
