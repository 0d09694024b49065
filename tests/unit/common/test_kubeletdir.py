"""Classifying kubelet-directory events: one reading of inotify serves the plugins and the agent."""

from asyncinotify import Mask

from plugvisor.common.kubeletdir import DirChange, DirEvent, classify


def test_a_kubelet_socket_created_or_moved_in_means_a_kubelet_listens():
    for mask in (Mask.CREATE, Mask.MOVED_TO):
        assert classify(mask, "kubelet.sock") == DirEvent(DirChange.KUBELET_SOCKET_CREATED, "kubelet.sock")


def test_other_files_appearing_are_reported_by_name():
    """A plugin learns that another one took its resource over from the new socket's name."""
    name = "plugvisor-gpu-123456-abcdef01.sock"
    assert classify(Mask.CREATE, name) == DirEvent(DirChange.FILE_CREATED, name)
    checkpoint = "kubelet_internal_checkpoint"
    assert classify(Mask.MOVED_TO, checkpoint) == DirEvent(DirChange.FILE_CREATED, checkpoint)


def test_a_file_deleted_or_moved_away_is_a_removal_naming_it():
    name = "plugvisor-gpu-123456-abcdef01.sock"
    for mask in (Mask.DELETE, Mask.MOVED_FROM):
        assert classify(mask, name) == DirEvent(DirChange.FILE_REMOVED, name)


def test_the_directory_going_away_is_reported():
    assert classify(Mask.DELETE_SELF, "") == DirEvent(DirChange.DIR_REMOVED, "")
