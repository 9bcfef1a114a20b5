#!/bin/bash
mv notes.md notes.txt
